"""Token choice: sampling settings, the draws, the screened output layer's exact sampling, tree acceptance."""
