"""The recipe's callbacks: EMA of the weights, and freezing the backbone while the new head warms up."""
