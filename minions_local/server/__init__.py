"""The OpenAI-compatible server (`minions-serve`) over one `Engine`.

cli.py loads the engine and runs uvicorn; app.py holds the Starlette routes;
schema.py checks requests; scheduler.py runs one generation at a time behind a
bounded queue; openai_format.py writes responses and stream chunks; errors.py maps
everything to the API's JSON error objects. Like the TUI, nothing here imports
torch: the engine is the only way to the models.
"""
