-- The jobs by state, every state: `/metrics` counts them at each scrape, where it read every
-- row of the table (the ended jobs stay until retention removes them, so they are most of it).
CREATE INDEX jobs_state ON jobs (state);
