#!/bin/bash
cd /tmp/d45b
export PYTHONPATH=/tmp/d45b HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
echo "start $(date -u +%FT%TZ)"; uptime; git log --oneline -1 | cut -c1-80
timeout 1800 .venv/bin/python scripts/experiments/compare_setups.py --workers 4 \
  --network-setup configs/network/paper_mix.yaml --diloco-inner-steps 15 25 \
  --setups collab_sync collab_diloco_h15 collab_diloco_h25 \
  --eval-every 5 --eval-batches 32 --timeout 900 \
  --output /tmp/d45b/out_fixed2 --runs /tmp/d45b/outputs/compare_diloco_netns_fixed2 \
  training.max_global_steps=75 task.total_steps=80 collaboration.target_batch_size=128 training.local_batch_size=16
echo "rc=$? $(date -u +%FT%TZ)"; uptime; ip netns list | grep -c . ; pgrep -c p2pd
