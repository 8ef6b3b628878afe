//! Where a setting's value came from: a flag, the environment, the config file, or the grid's
//! default (below `config` and `token`, which both name origins).

use std::fmt;
use std::path::PathBuf;

/// Where a setting's value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// A command-line flag, like `--cert`.
    Flag(&'static str),
    /// An environment variable.
    Env(&'static str),
    /// A key of the config file.
    File { key: &'static str, path: PathBuf },
    /// The grid's default.
    Default,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Flag(flag) => write!(f, "--{flag}"),
            Self::Env(var) => f.write_str(var),
            Self::File { key, path } => write!(f, "{key} in {}", path.display()),
            Self::Default => f.write_str("the grid default"),
        }
    }
}
