#!/bin/bash
# issue 45: the side-by-side on emulated paper-mix hosts (runs under flock /work/heavy.lock)
cd /tmp/d45
echo "lock taken $(date -u +%FT%TZ)"; free -g | head -2; uptime; git log --oneline -1 | cut -c1-80
if [ "$(date -u +%H%M)" \> "1515" ]; then echo "too late to start a 50-minute run"; exit 3; fi
timeout 2950 .venv/bin/python scripts/experiments/compare_setups.py --workers 4 \
  --network-setup configs/network/paper_mix.yaml --diloco-inner-steps 15 25 25:0.5 \
  --setups collab_sync collab_diloco_h25 collab_diloco_h15 collab_dpu ddp single collab_diloco_h25_lr0.5 \
  --eval-every 5 --eval-batches 32 --timeout 900 \
  --output /tmp/d45run/out --runs /tmp/d45/outputs/compare_diloco_netns \
  training.max_global_steps=75 task.total_steps=80 collaboration.target_batch_size=128 training.local_batch_size=16
echo "rc=$? $(date -u +%FT%TZ)"; uptime; ip netns list | grep -c . ; free -g | head -2
