"""Images in prompts: loading and checking them, the model processor's preprocessing, the
placeholder tokens an image takes in the prompt, and the inputs that carry pixels to the workers."""
