"""Framework adapters for kvturn.client, each importable only with its extra installed.

``kvturn.client.adapters.openai_agents`` (extra ``agents``): the OpenAI Agents SDK.
``kvturn.client.adapters.langchain`` (extra ``langchain``): LangChain's ``ChatOpenAI`` and
LangGraph threads.
"""
