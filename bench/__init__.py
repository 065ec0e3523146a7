"""The load-test client behind `shardserve bench`: streamed OpenAI requests at a set concurrency or rate,
timed chunk by chunk, summarized into tables, CSVs and plots. It speaks only the public OpenAI HTTP API,
so it imports nothing from the server (`app`, `engine`) and measures vLLM or any other server the same way.
Its packages come with the `shardserve[bench]` extra."""
