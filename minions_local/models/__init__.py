"""Where model files come from: the shipped demo family (checked against its manifest)
and real weights installed from the package index. Below the backends: they ask here
where a model's files are and whether they are intact."""
