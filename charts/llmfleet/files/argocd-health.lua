-- Argo CD health check for llmfleet.io/InferenceDeployment (argocd-cm key
-- resource.customizations.health.llmfleet.io_InferenceDeployment; see docs/gitops.md).
-- It reads the kstatus conditions the operator writes, so Argo CD and Flux agree:
--   status not yet written for this generation -> Progressing
--   Stalled=True (invalid spec, canary rolled back, pods that cannot start) -> Degraded
--   Reconciling=True (canary, promotion, rolling update, scaling, draining)  -> Progressing
--   Ready=True (the spec's revision serves all its replicas; or scaled to zero on purpose) -> Healthy
--   anything else -> Progressing
-- Lua 5.1 (Argo CD runs gopher-lua); no libraries needed.
local hs = {}

local function condition(kind)
  if obj.status == nil or obj.status.conditions == nil then
    return nil
  end
  for _, c in ipairs(obj.status.conditions) do
    if c.type == kind then
      return c
    end
  end
  return nil
end

local function describe(c, fallback)
  if c.message ~= nil and c.message ~= "" then
    return (c.reason or "") .. ": " .. c.message
  end
  if c.reason ~= nil and c.reason ~= "" then
    return c.reason
  end
  return fallback
end

if obj.status == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the llmfleet operator to report status"
  return hs
end

local generation = obj.metadata.generation
if generation ~= nil and obj.status.observedGeneration ~= generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end

local stalled = condition("Stalled")
if stalled ~= nil and stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = describe(stalled, "Stalled")
  return hs
end

local reconciling = condition("Reconciling")
if reconciling ~= nil and reconciling.status == "True" then
  hs.status = "Progressing"
  hs.message = describe(reconciling, "Reconciling")
  return hs
end

local ready = condition("Ready")
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = describe(ready, "Ready")
  return hs
end

hs.status = "Progressing"
if ready ~= nil then
  hs.message = describe(ready, "Not ready")
else
  hs.message = "Waiting for the Ready condition"
end
return hs
