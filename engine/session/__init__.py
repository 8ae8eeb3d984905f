"""The engine side of a training session (job type ``session``): the Tinker-compatible API's operations on models
that a client's own loop drives one request at a time. ``wire`` turns the SDK's protobuf bodies into tensors and
results back; ``losses`` are Tinker's losses as sums over tokens, on the registry's policy losses; ``sampler``
samples as Tinker's ``asample`` does; ``models`` holds a trained model and its optimizer between requests."""
