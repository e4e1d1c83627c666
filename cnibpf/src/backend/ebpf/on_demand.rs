//! Pinned maps opened at their first use. Opening one costs two `bpf()` calls (the pin, then
//! its info); a call that never touches a map — an ADD that translates no connection, reads
//! no counter — pays nothing for it.

use std::cell::OnceCell;

use aya::maps::{Map, MapError};

use super::open_pinned;
use crate::{backend::BackendError, paths::PinLayout};

pub(super) struct OnDemand<T> {
    pins: PinLayout,
    name: &'static str,
    map: OnceCell<T>,
}

impl<T: TryFrom<Map, Error = MapError>> OnDemand<T> {
    pub(super) fn new(pins: &PinLayout, name: &'static str) -> Self {
        Self {
            pins: pins.clone(),
            name,
            map: OnceCell::new(),
        }
    }

    /// The map, opened now if it was not yet.
    pub(super) fn open(&self) -> Result<&T, BackendError> {
        if let Some(map) = self.map.get() {
            return Ok(map);
        }
        let map = open_pinned(&self.pins, self.name)?;
        Ok(self.map.get_or_init(|| map))
    }

    /// [`Self::open`], for changes.
    pub(super) fn open_mut(&mut self) -> Result<&mut T, BackendError> {
        if self.map.get().is_none() {
            self.map = OnceCell::from(open_pinned::<T>(&self.pins, self.name)?);
        }
        Ok(self.map.get_mut().expect("opened just above"))
    }
}
