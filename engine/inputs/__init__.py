"""Turning what a user sends (text, token ids, chat messages, images) into what the engine runs."""
