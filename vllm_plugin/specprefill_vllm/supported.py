"""What the plugin supports: vLLM releases and model architectures."""

SUPPORTED_VLLM = ("0.32.",)
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
