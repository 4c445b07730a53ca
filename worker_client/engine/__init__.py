"""The reference inference engine of the worker: Qwen3.5 (Gated DeltaNet + gated attention) in PyTorch."""
