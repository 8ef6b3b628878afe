//! `ongrid-manager copy-store`: copies a manager's SQLite store into an empty PostgreSQL
//! database, for a site that moves to PostgreSQL (to run two manager replicas, for example).
//!
//! Both stores are opened as the manager opens them, so both schemas are brought up to this
//! release's; then, in one PostgreSQL transaction that holds the writers' lock
//! ([`super::postgres::WRITE_LOCK`]), every table is checked empty, copied row by row (parents
//! before the tables that refer to them; a table's references to itself filled in once all its
//! rows are there) and counted against the source. The tables the target's triggers keep from
//! the others' rows ([`DERIVED_TABLES`]) are not copied: the copied rows fill them as any write
//! does. Anything that does not match rolls everything back, so the target is either a full copy
//! or untouched. Values pass as text and PostgreSQL converts each to its column's type (SQLite's
//! 0 and 1 to a boolean, for example).
//!
//! The copy is the same store one generation on ([`ongrid_core::store_identity`]): the target's
//! own identity (made by its migration) is replaced by the source's, with the generation one
//! above, so clients that saw the SQLite manager accept the PostgreSQL ones and refuse a manager
//! still left on the SQLite file.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::Path;

use sqlx::sqlite::SqliteRow;
use sqlx::{Row, TypeInfo, ValueRef};

use super::{PostgresStore, SqliteStore, StoreError};

/// Why a copy did not happen; nothing was written to the target.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error("{0} does not exist: name the manager's SQLite file (its config's `database`)")]
    NoSource(String),
    #[error("opening {what}: {source}")]
    Open {
        what: String,
        #[source]
        source: StoreError,
    },
    #[error(
        "the target database is not empty (table {0} has rows): copy into a new, empty \
         database (createdb), or drop this one's tables first"
    )]
    NotEmpty(String),
    #[error(
        "the two schemas differ ({0}): run this with the ongrid-manager release that made the \
         SQLite file"
    )]
    Schemas(String),
    #[error(
        "table {table}: {copied} rows in the target after the copy, {expected} in the source; \
         nothing was written: stop every manager on the SQLite file and run the copy again"
    )]
    Count {
        table: String,
        expected: i64,
        copied: i64,
    },
    #[error("copying table {table}: {source}; nothing was written to the target")]
    Copy {
        table: String,
        #[source]
        source: sqlx::Error,
    },
    #[error("{0}; nothing was written to the target")]
    Database(#[from] sqlx::Error),
}

/// What was copied: each table's rows, and the copy's generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Copied {
    pub tables: BTreeMap<String, i64>,
    pub generation: i64,
}

/// The table of the store's identity, which every new database has a row in.
const IDENTITY_TABLE: &str = "store_identity";

/// The tables that triggers keep from the rows of others (the counts by state, migration 0028):
/// not copied, and not compared with the source's, whose zero counts may be rows the target
/// never needed.
const DERIVED_TABLES: &[&str] = &["state_counts"];

/// One table of the target as PostgreSQL describes it.
struct Table {
    name: String,
    /// (name, type as `format_type` writes it), in the table's order.
    columns: Vec<(String, String)>,
    primary_key: Vec<String>,
    /// Columns referring to rows of the same table (a job's previous and next job).
    self_references: Vec<String>,
}

/// Copies the SQLite file `from` into the empty PostgreSQL database `to`.
pub async fn sqlite_to_postgres(from: &Path, to: &str) -> Result<Copied, CopyError> {
    if !from.is_file() {
        return Err(CopyError::NoSource(from.display().to_string()));
    }
    let source = SqliteStore::open(from)
        .await
        .map_err(|source| CopyError::Open {
            what: format!("SQLite file {}", from.display()),
            source,
        })?;
    let target = PostgresStore::open(to)
        .await
        .map_err(|source| CopyError::Open {
            what: format!("PostgreSQL {}", super::Database::Postgres(to.to_owned())),
            source,
        })?;
    let copied = copy(&source, &target).await;
    source.close().await;
    target.close().await;
    copied
}

async fn copy(source: &SqliteStore, target: &PostgresStore) -> Result<Copied, CopyError> {
    // One read transaction: a consistent snapshot of the source.
    let mut reading = source.pool().begin().await?;
    let mut writing = target.pool().begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(super::postgres::WRITE_LOCK)
        .execute(&mut *writing)
        .await?;
    let tables = describe(&mut writing).await?;
    let source_tables: BTreeSet<String> = sqlx::query_scalar(
        "SELECT name FROM sqlite_master WHERE type = 'table' \
         AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\' AND name NOT LIKE '\\_sqlx%' ESCAPE '\\'",
    )
    .fetch_all(&mut *reading)
    .await?
    .into_iter()
    .collect();
    let target_tables: BTreeSet<String> = tables.iter().map(|t| t.name.clone()).collect();
    if source_tables != target_tables {
        let only_source: Vec<_> = source_tables.difference(&target_tables).collect();
        let only_target: Vec<_> = target_tables.difference(&source_tables).collect();
        return Err(CopyError::Schemas(format!(
            "tables only in SQLite: {only_source:?}, only in PostgreSQL: {only_target:?}"
        )));
    }
    for table in tables.iter().filter(|t| t.name != IDENTITY_TABLE) {
        let any: bool = sqlx::query_scalar(&format!(
            "SELECT EXISTS (SELECT 1 FROM {})",
            quoted(&table.name)
        ))
        .fetch_one(&mut *writing)
        .await?;
        if any {
            return Err(CopyError::NotEmpty(table.name.clone()));
        }
    }
    // The target's own identity gives way to the source's.
    sqlx::query(&format!("DELETE FROM {}", quoted(IDENTITY_TABLE)))
        .execute(&mut *writing)
        .await?;
    let copies: Vec<&Table> = tables
        .iter()
        .filter(|table| !DERIVED_TABLES.contains(&table.name.as_str()))
        .collect();
    let mut copied = BTreeMap::new();
    for table in &copies {
        let rows = copy_table(table, &mut reading, &mut writing)
            .await
            .map_err(|source| CopyError::Copy {
                table: table.name.clone(),
                source,
            })?;
        copied.insert(table.name.clone(), rows);
    }
    for table in &copies {
        let name = quoted(&table.name);
        let expected: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {name}"))
            .fetch_one(&mut *reading)
            .await?;
        let count: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {name}"))
            .fetch_one(&mut *writing)
            .await?;
        if count != expected || copied.get(&table.name) != Some(&expected) {
            return Err(CopyError::Count {
                table: table.name.clone(),
                expected,
                copied: count,
            });
        }
    }
    let generation: i64 = sqlx::query_scalar(&format!(
        "UPDATE {} SET generation = generation + 1 RETURNING generation",
        quoted(IDENTITY_TABLE)
    ))
    .fetch_one(&mut *writing)
    .await?;
    writing.commit().await?;
    reading.rollback().await?;
    Ok(Copied {
        tables: copied,
        generation,
    })
}

/// The target's tables (but the migrations' own), parents before the tables that refer to them.
async fn describe(db: &mut sqlx::PgConnection) -> Result<Vec<Table>, sqlx::Error> {
    let names: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname FROM pg_class c \
         WHERE c.relnamespace = current_schema()::regnamespace AND c.relkind = 'r' \
         AND c.relname NOT LIKE '\\_sqlx%' ORDER BY c.relname",
    )
    .fetch_all(&mut *db)
    .await?;
    let references: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT c.conrelid::regclass::text, c.confrelid::regclass::text, a.attname \
         FROM pg_constraint c \
         JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = ANY (c.conkey) \
         WHERE c.contype = 'f' AND c.connamespace = current_schema()::regnamespace",
    )
    .fetch_all(&mut *db)
    .await?;
    let mut tables = Vec::new();
    for name in names {
        let columns: Vec<(String, String)> = sqlx::query_as(
            "SELECT attname::text, format_type(atttypid, atttypmod) FROM pg_attribute \
             WHERE attrelid = $1::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
        )
        .bind(quoted(&name))
        .fetch_all(&mut *db)
        .await?;
        let primary_key: Vec<String> = sqlx::query_scalar(
            "SELECT a.attname::text FROM pg_index i \
             JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey) \
             WHERE i.indrelid = $1::regclass AND i.indisprimary ORDER BY a.attnum",
        )
        .bind(quoted(&name))
        .fetch_all(&mut *db)
        .await?;
        let self_references = references
            .iter()
            .filter(|(from, to, _)| unquoted(from) == name && unquoted(to) == name)
            .map(|(_, _, column)| column.clone())
            .collect();
        tables.push(Table {
            name,
            columns,
            primary_key,
            self_references,
        });
    }
    // Parents first: repeatedly take the tables whose references are all taken.
    let mut ordered: Vec<Table> = Vec::new();
    while !tables.is_empty() {
        let ready = tables.iter().position(|table| {
            references.iter().all(|(from, to, _)| {
                unquoted(from) != table.name
                    || unquoted(to) == table.name
                    || ordered.iter().any(|done| done.name == unquoted(to))
            })
        });
        match ready {
            Some(index) => ordered.push(tables.remove(index)),
            // A cycle between tables (none in this schema): keep the rest as they are, the copy
            // then fails on the reference and rolls back.
            None => ordered.append(&mut tables),
        }
    }
    Ok(ordered)
}

/// Copies one table's rows; returns how many.
async fn copy_table(
    table: &Table,
    reading: &mut sqlx::SqliteConnection,
    writing: &mut sqlx::PgConnection,
) -> Result<i64, sqlx::Error> {
    let names: Vec<String> = table.columns.iter().map(|(n, _)| quoted(n)).collect();
    let select = format!(
        "SELECT {} FROM {} ORDER BY rowid",
        names.join(", "),
        quoted(&table.name)
    );
    let rows: Vec<SqliteRow> = sqlx::query(&select).fetch_all(&mut *reading).await?;
    let mut bound = 0;
    let values: Vec<String> = table
        .columns
        .iter()
        .map(|(name, kind)| {
            if table.self_references.contains(name) {
                // Filled in below, once every row it may refer to is there.
                format!("NULL::{kind}")
            } else {
                bound += 1;
                format!("${bound}::text::{kind}")
            }
        })
        .collect();
    let insert = format!(
        "INSERT INTO {} ({}) VALUES ({})",
        quoted(&table.name),
        names.join(", "),
        values.join(", ")
    );
    for row in &rows {
        let mut query = sqlx::query(&insert);
        for (i, (name, _)) in table.columns.iter().enumerate() {
            if !table.self_references.contains(name) {
                query = query.bind(as_text(row, i)?);
            }
        }
        query.execute(&mut *writing).await?;
    }
    if !table.self_references.is_empty() {
        let position = |column: &str| table.columns.iter().position(|(n, _)| n == column);
        let mut sets = Vec::new();
        let mut binds = Vec::new();
        for column in &table.self_references {
            let (i, kind) = match position(column) {
                Some(i) => (i, &table.columns[i].1),
                None => continue,
            };
            binds.push(i);
            sets.push(format!(
                "{} = ${}::text::{kind}",
                quoted(column),
                binds.len()
            ));
        }
        let mut wheres = Vec::new();
        for column in &table.primary_key {
            if let Some(i) = position(column) {
                binds.push(i);
                wheres.push(format!(
                    "{} = ${}::text::{}",
                    quoted(column),
                    binds.len(),
                    table.columns[i].1
                ));
            }
        }
        let update = format!(
            "UPDATE {} SET {} WHERE {}",
            quoted(&table.name),
            sets.join(", "),
            wheres.join(" AND ")
        );
        for row in &rows {
            let mut query = sqlx::query(&update);
            for &i in &binds {
                query = query.bind(as_text(row, i)?);
            }
            query.execute(&mut *writing).await?;
        }
    }
    Ok(rows.len() as i64)
}

/// A SQLite value as the text PostgreSQL reads for its column's type; `None` for NULL.
fn as_text(row: &SqliteRow, i: usize) -> Result<Option<String>, sqlx::Error> {
    let raw = row.try_get_raw(i)?;
    if raw.is_null() {
        return Ok(None);
    }
    let kind = raw.type_info().name().to_owned();
    Ok(Some(match kind.as_str() {
        "INTEGER" => row.try_get_unchecked::<i64, _>(i)?.to_string(),
        "REAL" => row.try_get_unchecked::<f64, _>(i)?.to_string(),
        "BLOB" => {
            let bytes = row.try_get_unchecked::<Vec<u8>, _>(i)?;
            let mut text = String::from("\\x");
            for byte in bytes {
                let _ = write!(text, "{byte:02x}");
            }
            text
        }
        _ => row.try_get_unchecked::<String, _>(i)?,
    }))
}

/// `name` as an SQL identifier.
fn quoted(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// A `regclass` as text: the table's name, without the quotes it may carry.
fn unquoted(name: &str) -> String {
    name.trim_matches('"').replace("\"\"", "\"")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_quoted_and_read_back() {
        assert_eq!(quoted("jobs"), "\"jobs\"");
        assert_eq!(quoted("a\"b"), "\"a\"\"b\"");
        assert_eq!(unquoted(&quoted("a\"b")), "a\"b");
        assert_eq!(unquoted("jobs"), "jobs");
    }

    #[tokio::test]
    async fn a_missing_source_says_what_to_name() {
        let err = sqlite_to_postgres(
            Path::new("/nonexistent/manager.db"),
            "postgres://localhost/none",
        )
        .await
        .unwrap_err();
        assert!(err.to_string().contains("its config's `database`"), "{err}");
    }
}
