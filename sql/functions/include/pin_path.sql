{{- /* pin_path (a PL/pgSQL statement): search_path pinned to pg_catalog, pg_temp for the rest of
   this transaction, in a procedure that commits (which can carry no SET clause): first thing,
   and again right after each COMMIT, which ends the setting with its transaction (after the
   last one too, uniform, so that TestProceduresPinTheirPath can require it after every one). Qualified itself,
   so the caller's path picks nothing before it. */ -}}
    PERFORM pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', true);
