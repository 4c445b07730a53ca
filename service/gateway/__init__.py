"""The OpenAI-compatible HTTP gateway: text in, text out, over the scheduler's gRPC API.

`lattice-scheduler gateway --target HOST:PORT --model DIR --host H --port P` runs it.
Modules: `model_files` (tokenizer, chat template, generation defaults from the model
directory), `detokenize` (streamed text and stop strings), `protocol` (the OpenAI request
and response shapes), `scheduler_link` (the gRPC client), `generations` (in-flight
sequences, shared by retries), `app` (the routes), `metrics`, `server` (the process).
"""
