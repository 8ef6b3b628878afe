//! Which store the manager opens, read from the config's `database`: a SQLite file (a path, or
//! `sqlite:PATH`) or a PostgreSQL server (`postgres://...` or `postgresql://...`, built with the
//! `postgres` feature, on by default).

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{SqliteStore, Store, StoreResult};

/// Where the store lives.
#[derive(Clone, PartialEq, Eq)]
pub enum Database {
    /// A SQLite file, created when missing.
    Sqlite(PathBuf),
    /// A PostgreSQL database by its URL (which may hold a password: never printed).
    #[cfg(feature = "postgres")]
    Postgres(String),
}

impl Database {
    /// Reads the config's `database`; the error says what to write instead.
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if text.starts_with("postgres://") || text.starts_with("postgresql://") {
            return Self::postgres(text);
        }
        let path = text
            .strip_prefix("sqlite://")
            .or_else(|| text.strip_prefix("sqlite:"))
            .unwrap_or(text);
        if path.contains("://") {
            return Err(format!(
                "{:?} is neither a SQLite file nor a PostgreSQL URL: write a path \
                 (/var/lib/ongrid/manager.db or sqlite:/var/lib/ongrid/manager.db) or \
                 postgres://USER@HOST/DATABASE",
                redacted(text)
            ));
        }
        if path.is_empty() {
            return Err("must name a SQLite file or a PostgreSQL URL".to_owned());
        }
        Ok(Self::Sqlite(PathBuf::from(path)))
    }

    #[cfg(feature = "postgres")]
    fn postgres(url: &str) -> Result<Self, String> {
        use std::str::FromStr;
        sqlx::postgres::PgConnectOptions::from_str(url)
            .map_err(|e| format!("{:?} is not a PostgreSQL URL: {e}", redacted(url)))?;
        Ok(Self::Postgres(url.to_owned()))
    }

    #[cfg(not(feature = "postgres"))]
    fn postgres(url: &str) -> Result<Self, String> {
        Err(format!(
            "{:?}: this ongrid-manager was built without PostgreSQL; build it with \
             `cargo build -p ongrid-manager --features postgres` or use a SQLite file",
            redacted(url)
        ))
    }

    /// The SQLite file, `None` for a server.
    pub fn sqlite_file(&self) -> Option<&Path> {
        match self {
            Self::Sqlite(path) => Some(path),
            #[cfg(feature = "postgres")]
            Self::Postgres(_) => None,
        }
    }

    /// Opens the store (creating a SQLite file when missing) and brings its schema up to date.
    pub async fn open(&self) -> StoreResult<OpenedStore> {
        Ok(match self {
            Self::Sqlite(path) => OpenedStore::Sqlite(SqliteStore::open(path).await?),
            #[cfg(feature = "postgres")]
            Self::Postgres(url) => OpenedStore::Postgres(super::PostgresStore::open(url).await?),
        })
    }
}

/// An open store, closed once on shutdown.
#[derive(Debug, Clone)]
pub enum OpenedStore {
    Sqlite(SqliteStore),
    #[cfg(feature = "postgres")]
    Postgres(super::PostgresStore),
}

impl OpenedStore {
    /// The store for the loops and handlers (the connection pool is shared).
    pub fn shared(&self) -> Arc<dyn Store> {
        match self {
            Self::Sqlite(store) => Arc::new(store.clone()),
            #[cfg(feature = "postgres")]
            Self::Postgres(store) => Arc::new(store.clone()),
        }
    }

    /// Whether several managers may serve the database at once (PostgreSQL), one of them
    /// leading ([`crate::replicas`]).
    pub fn replicated(&self) -> bool {
        match self {
            Self::Sqlite(_) => false,
            #[cfg(feature = "postgres")]
            Self::Postgres(_) => true,
        }
    }

    /// The PostgreSQL store, `None` for SQLite.
    #[cfg(feature = "postgres")]
    pub fn postgres(&self) -> Option<&super::PostgresStore> {
        match self {
            Self::Sqlite(_) => None,
            Self::Postgres(store) => Some(store),
        }
    }

    /// Closes every connection.
    pub async fn close(&self) {
        match self {
            Self::Sqlite(store) => store.close().await,
            #[cfg(feature = "postgres")]
            Self::Postgres(store) => store.close().await,
        }
    }
}

/// The URL or path as it can be shown: a password in it replaced by `<secret>`.
fn redacted(text: &str) -> String {
    let Some((scheme, rest)) = text.split_once("://") else {
        return text.to_owned();
    };
    let (authority, tail) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    match authority.rsplit_once('@') {
        Some((user_info, host)) => match user_info.split_once(':') {
            Some((user, _password)) => format!("{scheme}://{user}:<secret>@{host}{tail}"),
            None => text.to_owned(),
        },
        None => text.to_owned(),
    }
}

impl fmt::Display for Database {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Sqlite(path) => write!(f, "SQLite file {}", path.display()),
            #[cfg(feature = "postgres")]
            Self::Postgres(url) => write!(f, "PostgreSQL {}", redacted(url)),
        }
    }
}

impl fmt::Debug for Database {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_or_a_sqlite_url_is_a_sqlite_file() {
        for text in [
            "/var/lib/ongrid/manager.db",
            "sqlite:/var/lib/ongrid/manager.db",
            "sqlite:///var/lib/ongrid/manager.db",
        ] {
            assert_eq!(
                Database::parse(text).unwrap(),
                Database::Sqlite(PathBuf::from("/var/lib/ongrid/manager.db")),
                "{text}"
            );
        }
        assert_eq!(
            Database::parse("m.db").unwrap().sqlite_file(),
            Some(Path::new("m.db"))
        );
    }

    #[test]
    #[cfg(feature = "postgres")]
    fn a_postgres_url_is_a_server_whose_password_is_never_shown() {
        let url = "postgres://ongrid:hunter2@db.example.org:5432/ongrid";
        let database = Database::parse(url).unwrap();
        assert_eq!(database, Database::Postgres(url.to_owned()));
        assert_eq!(database.sqlite_file(), None);
        for shown in [database.to_string(), format!("{database:?}")] {
            assert!(!shown.contains("hunter2"), "{shown}");
            assert!(
                shown.contains("postgres://ongrid:<secret>@db.example.org:5432/ongrid"),
                "{shown}"
            );
        }
        assert!(Database::parse("postgresql://ongrid@localhost/ongrid").is_ok());
    }

    #[test]
    fn another_scheme_is_refused_saying_what_to_write() {
        let err = Database::parse("mysql://u:pw@host/db").unwrap_err();
        assert!(err.contains("postgres://USER@HOST/DATABASE"), "{err}");
        assert!(!err.contains("pw@"), "{err}");
    }
}
