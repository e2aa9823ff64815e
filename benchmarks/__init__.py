"""Benchmarks of refckpt against the disk, torch.save, safetensors and plain DCP (not installed: run from a checkout)."""
