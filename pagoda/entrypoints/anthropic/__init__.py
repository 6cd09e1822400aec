"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) over the same
serving path as OpenAI's chat: a request becomes a chat request, its answer content blocks."""
