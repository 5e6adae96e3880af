"""The HTTP edge: the only folder that imports FastAPI, Starlette or uvicorn (server,
connection handling, auth, admission, the score / ops / OIP / feedback / review APIs and
their schemas). It turns HTTP into calls on the core and answers back."""
