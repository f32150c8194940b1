"""What the plugin supports: vLLM releases and model architectures."""

SUPPORTED_VLLM = ("0.32.", "0.33.")  # tested on; the gate itself is patch_points.PATCH_POINTS
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
