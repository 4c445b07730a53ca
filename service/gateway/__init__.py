"""The OpenAI-compatible HTTP gateway: text in, text out, over the scheduler's gRPC API.

`lattice-scheduler gateway --target HOST:PORT --model DIR --host H --port P` runs it.
Modules: `model_files` and `chat_template` (tokenizer, template and generation defaults of
the model directory), `detokenize` (streamed text and stop strings), `protocol` (the
OpenAI request bodies), `answers` (request to sequence, tokens to text), `responses` (the
OpenAI response JSON), `scheduler_link` (the gRPC client), `generations` (in-flight
sequences, shared by retries), `errors`, `metrics`, `app` (the routes), `server` and `cli`
(the process); `demo_model` and `demo_load` serve the local stack's demo.
"""
