-- A counter of changes to the site's GPUs (a GPU added, gone or moved, its health or MIG devices,
-- its mode, its drain; not its utilisation), bumped in the transaction of each: a manager keeps
-- the GPUs it read for planning and reads them again only when the counter moved. No row until
-- the first change (a copy of the store into an empty database finds this table empty).
CREATE TABLE inventory_version (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    version BIGINT NOT NULL
);
