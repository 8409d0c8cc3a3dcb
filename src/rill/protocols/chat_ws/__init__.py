"""``/ws/chat``: turn-based multimodal chat with streamed text and speech (shared/specs/chat-websocket.md)."""
