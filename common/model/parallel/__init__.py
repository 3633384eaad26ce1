"""Model parallelism: the tensor-parallel process group, sharded layers, and the ranks that follow rank 0."""
