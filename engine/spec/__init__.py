"""What the API validates and the workers read: the job spec and its parts. Torch-free (no torch, transformers or
numpy, also through what it imports), so that the API can import it; it imports no torch-side engine module."""
