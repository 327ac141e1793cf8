"""Scientific volumes: slab-parallel HDF5 reading and synthetic cosmology and segmentation data."""

from hybridpar.data.hdf5 import COSMOFLOW, SEGMENTATION, SampleFormat, SlabDataset, inspect_file, list_files
from hybridpar.data.loader import SlabLoader, eval_batches

__all__ = ["COSMOFLOW", "SEGMENTATION", "SampleFormat", "SlabDataset", "SlabLoader", "eval_batches",
           "inspect_file", "list_files"]
