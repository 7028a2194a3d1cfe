"""What is read: pairs, prompts and conversations checked row by row, and batches planned over ranks."""
