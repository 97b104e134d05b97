//! One process per SQLite file: `behest serve` holds an exclusive lock on `<database>.lock`
//! (a file beside the database) for its whole life, so a second server started on the same
//! file stops with a message naming it instead of taking over the first one's live runs. The
//! operating system releases the lock when the process ends, however it ends.

use std::fs::{File, TryLockError};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use sqlx::sqlite::SqliteConnectOptions;

use super::{StoreError, StoreResult};

/// The held lock of a SQLite database; released when dropped (or when the process ends).
#[derive(Debug)]
pub struct DatabaseLock {
    _file: File,
    path: PathBuf,
}

impl DatabaseLock {
    /// The lock file (`<database>.lock`).
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Locks the SQLite database of `url` (`sqlite://PATH`) for this process: `None` for another
/// backend or an in-memory database, which no other process can open.
///
/// # Errors
/// [`StoreError::InUse`] when another process holds the lock; [`StoreError::Lock`] when the
/// lock file cannot be created or locked (e.g. its directory does not exist).
pub fn lock_sqlite(url: &str) -> StoreResult<Option<DatabaseLock>> {
    if !url.starts_with("sqlite:") || url.contains(":memory:") || url.contains("mode=memory") {
        return Ok(None);
    }
    let options = SqliteConnectOptions::from_str(url)?;
    let database = options.get_filename().to_path_buf();
    let mut path = database.clone().into_os_string();
    path.push(".lock");
    let path = PathBuf::from(path);
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|error| StoreError::Lock {
            path: path.clone(),
            error,
        })?;
    match file.try_lock() {
        Ok(()) => Ok(Some(DatabaseLock { _file: file, path })),
        Err(TryLockError::WouldBlock) => Err(StoreError::InUse {
            database,
            lock: path,
        }),
        Err(TryLockError::Error(error)) => Err(StoreError::Lock { path, error }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_on_one_file_is_refused_until_the_first_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("x.db").display());
        let first = lock_sqlite(&url).unwrap();
        assert!(first.is_some());
        let error = lock_sqlite(&url).unwrap_err().to_string();
        assert!(error.contains("another behest process"), "{error}");
        assert!(error.contains("x.db"), "{error}");
        drop(first);
        assert!(lock_sqlite(&url).unwrap().is_some());
        assert!(lock_sqlite("sqlite::memory:").unwrap().is_none());
        assert!(lock_sqlite("postgres://h/db").unwrap().is_none());
    }
}
