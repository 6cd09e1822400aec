"""The model store: content-addressed blobs and one manifest per ``[host/]namespace/name:tag``, in
Ollama's layout and media types, so pagoda and Ollama read each other's stores; and an OCI
distribution client to push and pull them (see docs/architecture.md, "The model store").

Modules: ``layout`` (references and paths), ``blobs`` (verified, atomic blob writes),
``manifests`` (the manifest and config JSON, garbage collection), ``modelfile`` (Ollama's
Modelfile), ``create`` (Modelfile → layers → manifest), ``oci_client`` (the OCI client) and
``oci_http`` (its HTTP: auth, where credentials go, capped reads), ``ollama_store`` (Ollama's own
store, read in place), ``model_info`` (GGUF metadata for ``show``), ``load`` (a store model → the
files the engine loads), ``commands`` (the CLI verbs).
Nothing here imports torch.
"""
