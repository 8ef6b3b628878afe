//! Rebuilds the crate when a migration is added: `sqlx::migrate!` embeds
//! `migrations/` at compile time and cargo would not notice a new file otherwise.

fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
