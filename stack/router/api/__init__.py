"""The public APIs the router speaks: OpenAI (chat, completions, models), Anthropic Messages, Responses."""
