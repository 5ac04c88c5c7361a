"""Data for RL post-training: tokenizers and chat templates (``tokenizer``), RL/SFT/preference
datasets (``datasets``), the resumable data-parallel sampler (``sampler``), collators and TensorDict
conversion (``collate``), files from any fsspec URL (``files``), and the demo's tasks (``echo``,
``arithmetic``). Submodules are imported on use; nothing heavy is imported here."""
