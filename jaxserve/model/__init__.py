"""The Llama-family model, its paged attention and its weight loading."""
