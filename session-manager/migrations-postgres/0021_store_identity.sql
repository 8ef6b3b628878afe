-- Which copy of the store this is: a random id made with the store (kept by its copies) and a
-- generation, 1 for a new store, raised by `ongrid-manager copy-store` and `ongrid-manager
-- mark-restored`. Managers send it with every answer; clients refuse a manager answering from
-- an older generation than one they saw (a replica left on the old database after a restore).
-- Port of the SQLite migration of the same name; the id is hex like SQLite's.
CREATE TABLE store_identity (
    only_row INTEGER PRIMARY KEY CHECK (only_row = 1),
    store_id TEXT COLLATE "C" NOT NULL,
    generation BIGINT NOT NULL CHECK (generation >= 1)
);
INSERT INTO store_identity (only_row, store_id, generation)
VALUES (1, replace(gen_random_uuid()::text, '-', ''), 1);
