"""The probe and the features it reads: hidden states and token entropies."""
