import os
import sys

# tests/gpu imports the CPU test modules and dist_utils by name.
sys.path.insert(0, os.path.dirname(__file__))
