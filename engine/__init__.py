"""The reference engine: a target model on prompt tokens at explicit positions, behind OpenAI completions."""
