"""The gateway: an OpenAI-compatible proxy that compresses long prompts with SpecPrefill."""
