//! Reading a binary's TOML config file: the text, then the file's own struct (each binary's
//! struct has `#[serde(deny_unknown_fields)]`, so a misspelt key is refused, not ignored).
//! Validation into domain types stays with each binary; its `ConfigError` converts from
//! [`FileError`] into its own variants.

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;

/// Why a config file could not be read or parsed.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("cannot read config file {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config file {path} is not valid")]
    Parse {
        path: PathBuf,
        #[source]
        source: toml::de::Error,
    },
}

/// The text of the config file at `path`.
pub fn read(path: &Path) -> Result<String, FileError> {
    std::fs::read_to_string(path).map_err(|source| FileError::Read {
        path: path.to_owned(),
        source,
    })
}

/// Parses `text` (read from `path`, which is only used in messages) as TOML into `T`.
pub fn parse<T: DeserializeOwned>(text: &str, path: &Path) -> Result<T, FileError> {
    toml::from_str(text).map_err(|source| FileError::Parse {
        path: path.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct File {
        #[allow(dead_code)]
        listen: String,
    }

    #[test]
    fn unknown_keys_are_refused_naming_the_file_and_key() {
        let err =
            parse::<File>("listen = \"x\"\nlisten_port = 1\n", Path::new("g.toml")).unwrap_err();
        assert!(matches!(err, FileError::Parse { .. }), "{err:?}");
        let chain = format!("{:#}", anyhow::Error::from(err));
        assert!(
            chain.starts_with("config file g.toml is not valid: "),
            "{chain}"
        );
        assert!(chain.contains("listen_port"), "{chain}");
    }

    #[test]
    fn a_missing_file_names_it() {
        let err = read(Path::new("/nonexistent/ongrid.toml")).unwrap_err();
        assert!(matches!(err, FileError::Read { .. }), "{err:?}");
        assert_eq!(
            err.to_string(),
            "cannot read config file /nonexistent/ongrid.toml"
        );
    }
}
