"""What a request means, shared by the API and the worker: the job and batch states, tools,
structured-output constraints, chat prompts and the context budget. No Flask, no database
sessions, no Redis: both sides import it, and `app.services` builds on it."""
