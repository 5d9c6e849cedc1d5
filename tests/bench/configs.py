"""Real architectures' config.json fields (no weights) used by the plan tests and the GPU check."""

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 40960,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
# z-lab's Qwen3-8B-DFlash-b16 shape: 5 Qwen3 layers of the target's width, 5 context layers.
QWEN3_8B_DRAFT = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 40960,
    "block_size": 16, "num_target_layers": 36, "dflash_config": {"mask_token_id": 151669,
                                                                 "target_layer_ids": [1, 9, 17, 25, 33]},
}
# A Qwen3.5-27B-like hybrid VLM: 48 Gated DeltaNet layers + 16 gated full-attention layers.
QWEN35_HYBRID = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408,
        "num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "max_position_embeddings": 262144, "dtype": "bfloat16", "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000}},
    "vision_config": {"depth": 27},
}
QWEN35_DRAFT = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "vocab_size": 248320, "hidden_size": 5120,
    "intermediate_size": 17408, "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "block_size": 16,
    "num_target_layers": 64, "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]},
}
