{{- /* The attributes of a function whose plans hold the installation's secrets (the provider
   key's prefixes, folded into the plan once a session: include/provider_key.sql). A plan is
   printed to the session that asks for it (debug_print_plan, or a LOG message of any plan,
   auto_explain's, which client_min_messages = log sends to the client), and that session may
   be the application's or an operator's: while the function runs, no plan is printed and no
   LOG message reaches the client. Both are restored on return. */ -}}
SET debug_print_plan = off
SET client_min_messages = notice
