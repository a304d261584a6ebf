"""The torch reference backend: every op written plainly in PyTorch, differentiable, runs anywhere."""
