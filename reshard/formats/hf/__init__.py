"""Hugging Face's files in one place: its folder and shard conventions (sharding: split_state_dict_into_shards and
config.json read as values; files: what a folder holds beside the weights), a save_pretrained folder's weights
(weights, model: their order and ties from config.json; safetensors_reader: a folder or file of safetensors alone),
and the Trainer's checkpoint-N/ (trainer: its own torch.save files; trainer_weights: its save_only_model form).
The Trainer's files around a DeepSpeed or FSDP checkpoint are a training framework's, beside the others in
framework/hf_trainer.py."""
