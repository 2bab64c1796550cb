-- Argo CD health of a GPUDomain (gpu-agent.io, v1beta1 and v1alpha1), from the Ready condition the
-- cluster agent writes (status.conditions, metav1.Condition). Without this script Argo CD calls a
-- GPUDomain Healthy as soon as it exists.
--   Progressing: no status or no Ready condition yet, a spec the agent has not folded yet
--                (observedGeneration behind metadata.generation), Ready=Unknown (Initializing),
--                or Ready=False with MembersMissing (forming, or waiting for a node that left)
--   Degraded:    Ready=False for any other reason (MembersNotReady, CliqueFull)
--   Healthy:     Ready=True for the current generation
-- Plain Lua 5.1 (Argo CD runs gopher-lua): obj is the live object, its lists 1-based tables.
local hs = {}
local generation = obj.metadata and obj.metadata.generation
local status = obj.status
if status == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the cluster agent's first status"
  return hs
end
-- A status (or condition) of an older generation than the spec's: the agent has not answered the spec yet.
local function behind(observed, what)
  if generation ~= nil and observed ~= nil and observed ~= generation then
    hs.status = "Progressing"
    hs.message = "Waiting for the cluster agent to fold generation " .. tostring(generation)
      .. " (" .. what .. " is of generation " .. tostring(observed) .. ")"
    return true
  end
  return false
end
if behind(status.observedGeneration, "status") then
  return hs
end
local ready = nil
if status.conditions ~= nil then
  for _, condition in ipairs(status.conditions) do
    if condition.type == "Ready" then
      ready = condition
    end
  end
end
if ready == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the Ready condition"
  return hs
end
-- The condition's own observedGeneration, where written, must be current too.
if behind(ready.observedGeneration, "Ready") then
  return hs
end
local message = ready.message
if message == nil or message == "" then
  message = ready.reason or ("Ready=" .. tostring(ready.status))
end
hs.message = message
if ready.status == "True" then
  hs.status = "Healthy"
elseif ready.status == "False" and ready.reason ~= "MembersMissing" then
  hs.status = "Degraded"
else
  hs.status = "Progressing"
end
return hs
