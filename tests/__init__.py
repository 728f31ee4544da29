import os

# Inductor's C++ kernels, compiled here on the CPU as stand-ins for a GPU's Triton kernels,
# without SIMD: they compile in about half the CPU time, and what the tests look at (what
# compiles and when, what is stored and found again, the losses and pixels) is the same.
# Set before torch reads it (at import), for the tests' own process and every one it starts.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
