"""SwAV (ResNet, multi-crop, Sinkhorn swapped prediction) pretraining on the shared collaborative core."""
