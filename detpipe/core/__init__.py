"""The ground floor: process-wide helpers every other package uses and which import nothing above them
(tests/unit/test_layering.py): one-line errors and the program runner (`errors`), atomic files (`files`), progress,
worker pools, a process bound to its parent (`lifeline`), paths, the launcher-to-worker environment
(`worker_env`), the collective helpers (`distributed`, detectron2's ``comm``), server sockets (`net`), box formats
(`boxes`) and the trained-model file (`model_file`)."""
