"""Small helpers every room uses, importing nothing else of asyncrl: derived seeds (`seeding`), loading a user's
file by path (`user_code`), an event loop on a thread of its own (`background_loop`), Hugging Face Hub names
resolved to local files (`hub`)."""
