#!/bin/bash
# the rpc-bytes breakdown of one diloco H=25 swarm on loopback (the comparison's recipe, no emulated links)
cd /tmp/d45b
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
export RPC_BYTES_DIR=/tmp/rpc_bytes PYTHONPATH=/tmp/d45b/paper_results/comparison/diloco/rpc_bytes:/tmp/d45b
rm -rf $RPC_BYTES_DIR /tmp/rpcrun; mkdir -p $RPC_BYTES_DIR
echo "start $(date -u +%FT%TZ)"; uptime; git log --oneline -1 | cut -c1-80
timeout 900 .venv/bin/python scripts/local_swarm.py --config configs/albert/tiny.yaml --trainers 4 --aux 1 \
  --output /tmp/rpcrun monitor.wandb_mode=disabled monitor.refresh_seconds=0.5 training.num_threads=1 \
  task.heldout_fraction=0.05 monitor.checkpoint_every_steps=5 training.max_global_steps=75 task.total_steps=80 \
  collaboration.target_batch_size=128 training.local_batch_size=16 collaboration.semantics=diloco \
  collaboration.inner_steps=25 collaboration.run_id=compare_diloco_h25 collaboration.expected_peers=4
echo "rc=$? $(date -u +%FT%TZ)"; uptime
sleep 4
PYTHONPATH=/tmp/d45b .venv/bin/python paper_results/comparison/diloco/rpc_bytes/summarise.py $RPC_BYTES_DIR /tmp/rpc_h25_loopback.json
