"""Multimodal inputs (images) on the front end: loading them (media.py), turning them into the
encoder's input (image_processor.py), and expanding a prompt's placeholders into the positions
the encoder's output fills, with each image's content hash (processor.py). No torch here: the
workers turn the pixel arrays into tensors (worker/encoder_cache.py)."""
