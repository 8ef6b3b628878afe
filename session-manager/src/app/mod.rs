//! The actions a person asks for both through the API and through a dashboard form, each
//! written once: [`sessions`] (create, hold, release, keep alive, remove), [`images`] (freeze a
//! session) and [`institutes`] (add, remove). An action looks up what it acts on, asks
//! [`crate::domain`] for the decision, writes it, ticks or wakes the scheduler and logs it; the
//! API's handler modules and `crate::dashboard::actions` call it and render the outcome.
//!
//! Refusals whose advice differs between a terminal and a page (a `devctl` command to run, or
//! a control of the page) come back as a variant of the action's error, for each caller to word;
//! everything else (lookups, the domain's refusals, the store failing) is an [`ApiError`] worded
//! the same for both.
//!
//! [`ApiError`]: super::ApiError

pub mod images;
pub mod institutes;
pub mod sessions;

/// Where a person asked for an action, for the logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// The HTTPS API (`devctl`).
    Api,
    /// A form of the web dashboard.
    Dashboard,
}

impl Via {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Api => "api",
            Self::Dashboard => "dashboard",
        }
    }
}
