//! Site policy: who may use the site and under which accounting group ([`admission`]), and who
//! goes first among waiting requests by fair share weighted by GPU cost ([`fairshare`]), and how
//! much each user and group may hold at once ([`limits`]), and which GPUs an owner group owns or
//! a reservation holds for a group ([`reservations`]). Pure
//! functions over the validated `[policy]` config and what the caller's credential shows; the
//! API's caller extractor asks before a user record is made, so a certificate the site does
//! not admit leaves nothing behind.

pub mod admission;
pub mod fairshare;
pub mod limits;
pub mod reservations;

pub use admission::{Admission, AdmitRule, Admitted, GroupName, Principal};
