"""Export: the wrappers, the parity gate, the model card."""
